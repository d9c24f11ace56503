"""llama.cpp's server as a peer in greedy agreement: the same token prompts, its argmax
continuations read back as token ids.

    with LlamaGreedy(binary, "model.gguf", port=8131) as peer:
        tokens = peer.generate(prompt_ids, max_tokens=32)

The server runs one slot on 2 threads over 127.0.0.1 only, and is stopped (by its own
PID) on leaving the block. Prompts go in as token ids, so both systems see the same
tokens whatever their chat templates do; `/completion` with temperature 0 and top-k 1
takes the argmax at every step, `ignore_eos` keeps it going to `max_tokens`, and
`return_tokens` gives the ids back (no text round trip, which is not one to one).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from .startup import wait_ready


class LlamaGreedy:
    """A llama-server process for one GGUF file; see the module docstring."""

    def __init__(self, binary: Path, model: Path, port: int, context: int = 4096,
                 threads: int = 2, ready_timeout_s: float = 300.0) -> None:
        self.command = [str(binary), "-m", str(model), "--host", "127.0.0.1",
                        "--port", str(port), "-np", "1", "-c", str(context),
                        "-t", str(threads), "-tb", str(threads)]
        self.url = f"http://127.0.0.1:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaGreedy":
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        try:
            wait_ready(self.process, self.url + "/health", self.ready_timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def generate(self, prompt: list[int], max_tokens: int, timeout_s: float = 600.0
                 ) -> list[int]:
        """The server's greedy continuation of `prompt` (token ids), `max_tokens` long."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        response = httpx.post(self.url + "/completion", json=body, timeout=timeout_s)
        response.raise_for_status()
        tokens = response.json().get("tokens")
        if not isinstance(tokens, list):
            raise RuntimeError("llama-server gave no token ids (its /completion predates "
                               "return_tokens)")
        return [int(token) for token in tokens]
