from prefixflow.services.registry import main_for

if __name__ == "__main__":
    main_for("sink")
