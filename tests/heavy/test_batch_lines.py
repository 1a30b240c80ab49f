"""The batch service's chat and embedding success lines are vLLM's own
`BatchRequestOutput` (`vllm/entrypoints/launchers/run_batch.py`; its types cover neither
completions nor OpenAI's error bodies: those are checked with the `openai` package's types
in tests/unit/test_batchapi.py). Heavy: importing vLLM's OpenAI entrypoints takes ~10 s."""

from __future__ import annotations

import pytest

from prefixflow.shared.openai_batch import result_line
from tests.openai_lines import check_output_line, check_vllm

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


def test_chat_and_embedding_success_lines_are_vllm_batch_request_outputs():
    row = {"output": "hi", "outputs": ["hi", "yo"], "finish_reason": "stop", "prompt_tokens": 3, "cached_tokens": 1,
           "output_tokens": 2, "embedding": [0.5, -1.0]}
    for url in ("/v1/chat/completions", "/v1/embeddings"):
        good, line = result_line("r1", url, row, "tiny", 1)
        assert good
        check_output_line(line, url)
        check_vllm(line)
