"""How fast sample.py draws tokens with its KV cache, against the decoding it replaced (the whole
context through the model again for every new token).

    python benchmarks/sample_speed.py                     # the default preset (small), this machine
    python benchmarks/sample_speed.py --tokens 100 --rounds 3 --out-dir /tmp/speed
    python benchmarks/sample_speed.py --render benchmarks/results/sample-speed.json

The model has random weights (the preset's shape, GPT-2's vocabulary padded to 50,304, as many
positions as the preset's --seq-len): how fast a token is drawn does not depend on what the weights
say. Each decoder draws what sample.py draws by default: one sample of 200 tokens after a one-token
prompt, temperature 0.8, top-k 200, fp32. "with KV cache" is minigpt.core.sample.generate, which
sample.py runs; "without" is the loop sample.py ran before it, with today's draw (the cache's own
gain); "sample.py before it" is that loop with the draw it had then, over every id (sample.py's gain
in all); "the head as nn.Linear reads it" is the cache with the head's weight as the model stores
it, (vocab, d_model), in place of its (d_model, vocab) copy (that layout's own gain). The old
decoders are kept here, and only here, to measure against. All run in this one process, in
interleaved rounds (with, without, before, the stored head, with again for the A/A check), after an
untimed warm-up of each, from the same seed: a drift of the machine spreads over them all. Per
decoder: tokens/s of each round (new tokens over the seconds of the whole call, the
prompt's pass included), the median and the spread; the speed-up with its 95% interval
(minigpt.analysis.stats); the machine and its load: the load average at the start and the end, and
the share of the cores other processes took (minigpt.config.busy_share) over the run and each round.
Writes benchmarks/results/sample-speed.json and .md; --out-dir writes elsewhere, --force overwrites.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common as bench

NAME = "sample-speed"  # <out-dir>/sample-speed.{json,md}
WITH, WITHOUT = "with KV cache", "without (whole context each token)"
LINEAR_HEAD = "with KV cache, the head as nn.Linear reads it"
BEFORE = "sample.py before it (whole context, the draw over every id)"
# sample.py's defaults: what a user who types `python sample.py` waits for.
TOKENS, PROMPT_TOKENS, TEMPERATURE, TOP_K = 200, 1, 0.8, 200
WARMUP_TOKENS = 20  # untimed, per decoder, before the rounds: first calls allocate and pick kernels


def build_model(preset: str, device: str, seed: int):
    """A GPT of the preset's shape with random weights, in eval mode (as sample.py loads one)."""
    import torch

    from minigpt.config import GPT2_VOCAB, PRESETS, pad_vocab
    from minigpt.core.model import GPT, GPTConfig

    p = PRESETS[preset]
    torch.manual_seed(seed)
    cfg = GPTConfig(pad_vocab(GPT2_VOCAB), p["seq_len"], p["n_layers"], p["n_heads"], p["d_model"], p["d_ff"])
    return GPT(cfg).to(device).eval()


def without_cache(model, idx, max_new_tokens: int, draw, generator):
    """sample.py's decoding before the KV cache: the whole (cropped) context through the model's
    forward for every new token, the logits of every position made and all but the last dropped."""
    import torch

    context = model.cfg.max_position_embeddings
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -context:])
            nxt = draw.next_token(logits[:, -1, :], generator)
            idx = torch.cat([idx, nxt], dim=1)
    return idx


def before_it(model, idx, max_new_tokens: int, draw, generator):
    """sample.py's decoding as it was, whole: without_cache's loop and the draw it had then (every
    id's probability made, the ids below the top_k-th masked, one draw over the whole vocabulary)."""
    import math

    import torch
    import torch.nn.functional as F

    context = model.cfg.max_position_embeddings
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(idx[:, -context:])[0][:, -1, :].float() / draw.temperature
            logits[:, draw.vocab_size :] = -math.inf
            kth = torch.topk(logits, draw.top_k, dim=-1).values[:, -1:]
            probs = F.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx


def linear_head(model, idx, max_new_tokens: int, draw, generator):
    """generate() with every cache's head the model's own (vocab, d_model) weight, transposed in the
    product as nn.Linear does it, instead of the (d_model, vocab) copy KVCache makes."""
    from minigpt.core import sample

    class StoredHead(sample.KVCache):
        def __init__(self, model):
            super().__init__(model)
            self.head = model.lm_head.weight.detach().t()  # a view: nn.Linear's product, no copy

    kept, sample.KVCache = sample.KVCache, StoredHead
    try:
        return sample.generate(model, idx, max_new_tokens, draw, generator)
    finally:
        sample.KVCache = kept


def decoders() -> dict:
    from minigpt.core.sample import generate

    return {WITH: generate, WITHOUT: without_cache, BEFORE: before_it, LINEAR_HEAD: linear_head}


def timed(decode, model, args, tokens: int) -> tuple[float, float | None, list[int]]:
    """(tokens/s, the share of the cores other processes took meanwhile, the tokens drawn)."""
    import torch

    from minigpt.config import EOT, busy_share, cpu_seconds
    from minigpt.core.sample import Draw

    draw = Draw(TEMPERATURE, TOP_K, model.cfg.vocab_size)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    idx = torch.full((1, args.prompt_tokens), EOT, dtype=torch.long, device=args.device)
    before = cpu_seconds()
    t0 = time.perf_counter()
    out = decode(model, idx, tokens, draw, generator)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return tokens / seconds, busy_share(before, cpu_seconds()), out[0, args.prompt_tokens :].tolist()


def measure(args, meta: dict) -> dict:
    """Interleaved rounds of both decoders (and the cached one's A/A copy); the summary."""
    import torch

    from minigpt.config import BUSY, busy_share, cpu_seconds

    model = build_model(args.preset, args.device, args.seed)
    runs = decoders()
    for name, decode in runs.items():
        print(f"[{name}] warm-up ({WARMUP_TOKENS} tokens)", flush=True)
        timed(decode, model, args, WARMUP_TOKENS)
    rounds: dict[str, list] = {name: [] for name in bench.with_aa(list(runs))}
    start = cpu_seconds()
    for r in range(args.rounds):
        for name in rounds:
            rate, busy, drawn = timed(runs[name.removesuffix(bench.AA)], model, args, args.tokens)
            rounds[name].append({"tokens_per_s": rate, "busy": busy, "tokens": drawn})
            print(f"[{name}] round {r + 1}/{args.rounds}: {rate:,.1f} tokens/s", flush=True)
    meta["busy_run"] = busy_share(start, cpu_seconds())
    meta["threads"] = torch.get_num_threads()
    cfg = model.cfg
    meta["model"] = {
        "preset": args.preset,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "d_model": cfg.d_model,
        "d_ff": cfg.d_ff,
        "positions": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights": f"random (seed {args.seed})",
    }
    results = {}
    for name in runs:
        rates = [x["tokens_per_s"] for x in rounds[name]]
        busy = [x["busy"] for x in rounds[name]]
        results[name] = {
            "tokens_per_s": bench.spread(rates),
            "rounds": rates,
            "busy_rounds": busy,
            "busy_rounds_over": sum(b is not None and b > BUSY for b in busy),
        }
    copy = [x["tokens_per_s"] for x in rounds[bench.aa_name(WITH)]]
    meta["aa"] = [bench.aa_check(WITH, results[WITH]["rounds"], copy, "tokens/s of each round")]
    method = "interleaved rounds in one process"
    same = [a["tokens"] == b["tokens"] for a, b in zip(rounds[WITH], rounds[WITHOUT])]
    return {
        "meta": meta,
        "results": results,
        "speedup": bench.ratio(results[WITHOUT]["rounds"], results[WITH]["rounds"], method),
        "speedup_before": bench.ratio(results[BEFORE]["rounds"], results[WITH]["rounds"], method),
        "speedup_head": bench.ratio(results[LINEAR_HEAD]["rounds"], results[WITH]["rounds"], method),
        "same_tokens_rounds": sum(same),
    }


def markdown(data: dict) -> str:
    meta, res, m = data["meta"], data["results"], data["meta"]["model"]
    lines = bench.header("Sampling speed: sample.py with and without its KV cache", meta)
    lines += bench.load_lines(meta)
    if meta.get("busy_run") is not None:
        lines += [
            f"Other processes took {meta['busy_run']:.0%} of the cores over the measured rounds "
            "(minigpt.config.busy_share); each round's share is in the .json.",
            "",
        ]
    lines += bench.aa_lines(meta)
    lines += [
        f"Model: the `{m['preset']}` preset's shape ({m['n_layers']} layers, {m['n_heads']} heads, d_model "
        f"{m['d_model']}, d_ff {m['d_ff']}, {m['positions']} positions, vocabulary {m['vocab_size']:,}; "
        f"{m['parameters'] / 1e6:.1f}M parameters) with {m['weights']} weights: decoding speed does not "
        "depend on what the weights say.",
        "",
        f"Each round draws one sample of {meta['tokens']} tokens after a {meta['prompt_tokens']}-token "
        f"prompt (temperature {TEMPERATURE}, top-k {TOP_K}, fp32, {meta['threads']} threads, "
        f"{meta['device']}) with each decoder, interleaved, {meta['rounds']} rounds in one process after "
        f"an untimed warm-up of {WARMUP_TOKENS} tokens each. Tokens/s: new tokens over the seconds of "
        "the whole call, the prompt's pass included.",
        "",
        "| decoder | tokens/s (median) | min - max | rounds | rounds busy |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        t = r["tokens_per_s"]
        rounds = ", ".join(f"{x:,.1f}" for x in r["rounds"])
        lines.append(
            f"| {name} | {t['median']:,.1f} | {t['min']:,.1f} - {t['max']:,.1f} | {rounds} | "
            f"{r['busy_rounds_over']} of {len(r['rounds'])} |"
        )
    lines += [
        "",
        f"Speed-up with the cache (its tokens/s over the other's, the same draw in both, 95% interval): "
        f"**{bench.ratio_text(data['speedup'])}**.",
        "",
        *(
            [
                "sample.py against what it ran before (the cache, and a draw among the top-k ids only in "
                f"place of one over all {m['vocab_size']:,} ids): "
                f"**{bench.ratio_text(data['speedup_before'])}**.",
                "",
            ]
            if "speedup_before" in data
            else []
        ),
        *(
            [
                "The head's (d_model, vocab) copy against the weight as the model stores it, both with "
                f"the cache: **{bench.ratio_text(data['speedup_head'])}**.",
                "",
            ]
            if "speedup_head" in data
            else []
        ),
        f"The two decoders drew the same tokens from the same seed in {data['same_tokens_rounds']} of "
        f"{meta['rounds']} rounds (they differ only by float rounding, which can tip a draw).",
        "",
        "A round is busy when other processes took more than a quarter of the cores while it ran.",
        "",
    ]
    return "\n".join(lines)


def parser():
    from minigpt.config import PRESETS

    p = bench.Parser(prog="benchmarks/sample_speed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="the model's shape")
    p.add_argument("--tokens", type=int, default=TOKENS, help="new tokens per round and decoder")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="the prompt's length")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (an interval needs 3)")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the draws' seed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    bench.output_flags(p, "measure nothing: write the .md again from a results .json")
    p.add_argument("--force", action="store_true", help="overwrite results that are already there")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.render:
        table = args.render.with_suffix(".md")
        return bench.render(p, args.render, lambda d: bench.write_md(table, markdown(d)))
    if min(args.tokens, args.prompt_tokens, args.rounds) < 1:
        p.error("--tokens, --prompt-tokens and --rounds must be at least 1")
    if args.tokens > 100_000 or args.prompt_tokens > 100_000:
        p.error("--tokens and --prompt-tokens: give at most 100,000 (sample.py's own bound)")
    if not 0 <= args.seed < 2**32:
        p.error(f"--seed {args.seed}: give a number in [0, 2^32)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    bench.check_out_dir(p, args.out_dir)
    bench.refuse_to_overwrite(p, args.out_dir / NAME, args.force)  # before anything is measured
    meta = {
        **bench.stamp([str(Path(__file__)), *(sys.argv[1:] if argv is None else argv)]),
        "machine": bench.machine(args.device),  # the device measured (stamp's default would be auto)
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "seed": args.seed,
        "device": args.device,
        **bench.refuse_if_busy(args.out_dir, args.busy),
        "noisy": args.noisy,
    }
    data = measure(args, meta)
    meta["load_end"] = bench.load_average()
    return bench.publish(args.out_dir, NAME, meta, data, markdown(data), "sample_speed.py")


if __name__ == "__main__":
    sys.exit(main())
