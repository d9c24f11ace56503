"""A summary of py-spy's raw samples (`py-spy record --format raw --threads`): the
functions where one thread's samples were (self) and the ones on their stacks
(inclusive), each as a count and a share of that thread's samples.

    python -m bench.folded samples.folded --thread kvserve-engine

`--thread` keeps the stacks whose thread label contains it (py-spy writes
"thread (ID): NAME" as each stack's first frame); with several such threads (one
engine per manager) the one with the most samples is summarised, or `--thread-id`
picks one. Line numbers are dropped from the inclusive list, so a function counts once
per stack.
"""

from __future__ import annotations

import argparse
import collections
import re


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    stacks = []
    with open(path) as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack:
                stacks.append((stack.split(";"), int(count)))
    return stacks


def summarise(stacks, thread: str | None, thread_id: str | None, rows: int) -> str:
    per_thread = collections.Counter()
    for frames, count in stacks:
        per_thread[frames[0]] += count
    labels = [label for label in per_thread
              if (thread is None or thread in label) and (thread_id is None or
                                                          f"({thread_id})" in label)]
    if not labels:
        raise SystemExit(f"no thread matches; threads: {per_thread.most_common(8)}")
    label = max(labels, key=per_thread.__getitem__)
    own, inclusive = collections.Counter(), collections.Counter()
    for frames, count in stacks:
        if frames[0] != label:
            continue
        own[frames[-1]] += count
        for name in {re.sub(r":\d+\)", ")", frame) for frame in frames[1:]}:
            inclusive[name] += count
    total = per_thread[label]
    lines = [f"{label}: {total} samples"]
    for title, counter in (("self", own), ("inclusive", inclusive)):
        lines.append(f"--- {title}")
        lines += [f"{count:7d} {100 * count / total:5.1f}% {name}"
                  for name, count in counter.most_common(rows)]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.folded", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--thread", default=None, help="part of the thread's name")
    parser.add_argument("--thread-id", default=None)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args(argv)
    print(summarise(read_stacks(args.path), args.thread, args.thread_id, args.rows))


if __name__ == "__main__":
    main()
