"""Host time of constrained decoding per engine step: filling the token bitmasks of
B constrained rows (llguidance, on the mask helper thread) and applying them to a
[B, vocab] logits matrix, for rows part-way through a JSON answer.

    python -m bench.grammar_masks --rows 16,32 --steps 64

Each row's matcher walks the same JSON text token by token; per step the tool times
the fill of every row's mask (what runs beside the forward pass) and the apply
(what the sampler adds to a step), and reports the median and p90 in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.structured.grammar import GrammarSpec
from engine.structured.grammar_masks import GrammarMasks, apply_masks

from .report import write_json

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": {
              "type": "object", "additionalProperties": False, "required": ["word", "count"],
              "properties": {"word": {"type": "string"}, "count": {"type": "integer"}}}}}}


class _Row:
    """The two fields of a request that the mask fill reads."""

    def __init__(self, grammar, max_new_tokens: int) -> None:
        self.grammar, self.max_new_tokens, self.generated_tokens = grammar, max_new_tokens, []


def measure(model: str, rows: int, steps: int) -> dict:
    from engine import load_model

    engine_model = load_model(model, progress=False)
    compiled = engine_model.grammars.compile(GrammarSpec("json_schema", SCHEMA))
    text = json.dumps({"items": [{"word": f"word{i}", "count": i} for i in range(40)]},
                      separators=(",", ":"))
    tokens = engine_model.tokenizer.encode(text, add_special_tokens=False)[:steps]
    batch = [_Row(compiled.new_matcher((2,)), 10_000) for _ in range(rows)]
    masks = GrammarMasks(torch.device("cpu"))
    logits = torch.randn(rows, int(engine_model.config.vocab_size))
    fills, applies = [], []
    for token in tokens:
        started = time.perf_counter()
        pending = masks.start(batch)
        bitmask = pending.wait()
        filled = time.perf_counter()
        apply_masks(logits, pending.rows, bitmask)
        fills.append(filled - started)
        applies.append(time.perf_counter() - filled)
        for row in batch:
            row.grammar.accept(token)
            row.generated_tokens.append(token)
    masks.close()

    def ms(values: list[float]) -> dict:
        ordered = sorted(values)
        return {"p50": round(statistics.median(ordered) * 1e3, 3),
                "p90": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3)}

    return {"rows": rows, "steps": len(tokens), "fill_ms": ms(fills), "apply_ms": ms(applies)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar_masks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = [measure(args.model, int(rows), args.steps) for rows in args.rows.split(",")]
    for result in results:
        print(f"{result['rows']:>3} rows: fill p50 {result['fill_ms']['p50']} ms "
              f"(p90 {result['fill_ms']['p90']}), apply p50 {result['apply_ms']['p50']} ms "
              f"(p90 {result['apply_ms']['p90']})")
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
