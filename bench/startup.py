"""Start-up and memory report of a server: time until it answers, peak resident
memory after loading and after a load run, and bytes written to disk on the way.

    python -m bench.startup --label kvserve --port 8040 --json kvserve.json -- \\
        python -m server --model smollm2-135m-instruct --port 8040
    python -m bench.startup --label llama.cpp --port 8041 --health /health -- \\
        llama-server -m model.gguf --port 8041 -np 8 -c 8192

Everything after `--` is the server's command line; it must listen on 127.0.0.1 at
`--port`. The tool polls `--health` until it returns 200 (ready time), reads the
process tree's peak RSS (VmHWM, the kernel's high-water mark of each process), runs
`bench.serve` at `--concurrency` against it, reads the peak again, and stops it with
SIGINT. `--watch-dir` (repeatable) names folders whose growth counts as written:
the server's cache (for kvserve, `$XDG_CACHE_HOME/kvserve`). With `--fresh-cache`
the server gets an empty XDG_CACHE_HOME of its own, so first-start costs show.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from .report import write_json


def peak_rss(pid: int) -> int:
    """The summed VmHWM (peak resident set) of a process and its children, in bytes."""
    total = 0
    root = psutil.Process(pid)
    for process in [root] + root.children(recursive=True):
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def folder_bytes(paths: list[Path]) -> int:
    return sum(f.stat().st_size for path in paths if path.exists()
               for f in path.rglob("*") if f.is_file())


def wait_ready(process: subprocess.Popen, url: str, timeout_s: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout_s:.0f} s")


def measure(args, command: list[str]) -> dict:
    base = f"http://127.0.0.1:{args.port}"
    environ = dict(os.environ)
    fresh = tempfile.mkdtemp(prefix="startup-cache-") if args.fresh_cache else None
    watched = [Path(p) for p in args.watch_dir] + ([Path(fresh)] if fresh else [])
    if fresh:
        environ["XDG_CACHE_HOME"] = fresh
    before = folder_bytes(watched)
    with open(args.log, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ)
    try:
        ready_s = wait_ready(process, base + args.health, args.timeout)
        result = {"label": args.label, "command": command, "ready_s": round(ready_s, 2),
                  "peak_rss_after_start_mb": round(peak_rss(process.pid) / 1e6, 1)}
        if args.concurrency:
            from .serve import main as serve

            report = serve(["--base-url", base, "--model", args.model,
                            "--concurrency", args.concurrency,
                            "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--label", args.label])
            result["serve"] = report
            result["peak_rss_after_load_mb"] = round(peak_rss(process.pid) / 1e6, 1)
        result["bytes_written"] = folder_bytes(watched) - before
        return result
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m bench.startup [options] -- SERVER COMMAND ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--health", default="/health", help="path answering 200 once ready")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name to send")
    parser.add_argument("--concurrency", default="8", help="bench.serve levels ('' = none)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to get ready")
    parser.add_argument("--watch-dir", action="append", default=[])
    parser.add_argument("--fresh-cache", action="store_true")
    parser.add_argument("--log", default=os.devnull, help="file for the server's output")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv[:split])
    result = measure(args, argv[split + 1:])
    summary = {k: v for k, v in result.items() if k not in ("serve", "command")}
    print(summary)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
