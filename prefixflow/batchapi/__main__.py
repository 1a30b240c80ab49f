import argparse

from prefixflow.batchapi.service import API_HELP, serve
from prefixflow.shared.outcomes import reported
from prefixflow.shared.process import config as cfgmod

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m batchapi", description=API_HELP)
    cfgmod.add_arguments(parser, cfgmod.ApiConfig)
    args = parser.parse_args()
    reported(lambda: serve(args))
