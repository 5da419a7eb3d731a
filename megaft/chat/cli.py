"""`megaft-chat RUN_DIR|HF_DIR [--prompt TEXT [--image PATH]] [options] [launcher.nproc=N parallel.tp=N device=D]`.

Without --prompt: an interactive chat in the terminal, answers streamed as they are
generated. With --prompt: one answer to stdout (nothing else there), then exit; with --image
too, about that image (a vision-language Gemma 3 checkpoint: megaft.chat.image).
Exit status: 0 done, 1 a rank failed, 2 a bad argument or nothing to chat with.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from megaft.cli_args import checked_arguments

OVERRIDES = ("launcher.nproc", "parallel.tp", "device")  # the megaft-train settings megaft-chat reads


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megaft-chat", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="a run dir (its newest checkpoint, LoRA adapters merged) or an HF checkpoint folder")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="launcher.nproc=N and/or parallel.tp=N (tensor parallel over N local ranks), device=cpu|cuda")
    p.add_argument("--prompt", help="answer this one user message on stdout and exit")
    p.add_argument("--image", help="with --prompt: an image the prompt is about (a vision-language Gemma 3 "
                   "checkpoint; docs/vision.md)")
    p.add_argument("--system", help="the system message")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temp > 0)")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws (with the answer's number)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer, in tokens")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="compute precision (autocast over fp32 weights); default: the run's precision, else fp32")
    p.add_argument("--template", default="auto",
                   help="chat template: auto (the run's or checkpoint's own), llama3, chatml or a .jinja file")
    return p


def parse_overrides(items: list[str]) -> tuple[int, str]:
    """(ranks, device) from KEY=VALUE strings; ValueError naming every bad one."""
    values, bad = {}, []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or key not in OVERRIDES:
            bad.append(item)
        else:
            values[key] = value
    if bad:
        raise ValueError(f"unknown setting(s) {' '.join(bad)}; megaft-chat reads {', '.join(OVERRIDES)} (KEY=VALUE)")
    try:
        sizes = {int(values[k]) for k in ("launcher.nproc", "parallel.tp") if k in values}
    except ValueError:
        raise ValueError("launcher.nproc and parallel.tp take a whole number") from None
    if len(sizes) > 1 or any(s < 1 for s in sizes):
        raise ValueError("megaft-chat runs tensor parallel only: launcher.nproc and parallel.tp must be one "
                         "number >= 1 (either one sets both)")
    device = values.get("device", "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device}; fix: device=auto, cpu or cuda")
    return (sizes.pop() if sizes else 1), device


def _problems(args) -> list[str]:
    problems = []
    if args.temp < 0:
        problems.append(f"--temp {args.temp:g}: a temperature is >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p:g}: top_p is in (0, 1]")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: at least 1")
    if args.image is not None and args.prompt is None:
        problems.append("--image needs --prompt (one answer about the image; the interactive chat takes no images "
                        "yet)")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    parsed = checked_arguments("megaft-chat", lambda: parse_overrides(args.overrides), lambda _: _problems(args))
    if parsed is None:
        return 2
    nproc, device = parsed
    from megaft.device import resolve_device

    if device == "cuda" and resolve_device("auto") != "cuda":
        print("megaft-chat: device=cuda but torch sees no CUDA GPU; fix: device=cpu or a CUDA build of torch",
              file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    from megaft.chat.engine import RankError
    from megaft.chat.load import ChatError, locate
    from megaft.chat.session import Session
    from megaft.chat.terminal import answer, chat_loop
    from megaft.inference.generate import Sampling

    engine = None
    try:
        chat = locate(args.dir, args.template, args.dtype)
        if chat.template is None:
            print(f"megaft-chat: warning: {chat.origin} has no chat template, so each line is continued as plain "
                  "text, without history; fix: --template chatml|llama3|FILE.jinja", file=sys.stderr)
        engine = _engine(chat, nproc, device)
        if args.image is not None:
            from megaft.chat.image import answer_image

            answer_image(engine, chat, args.prompt, args.image, sampling=Sampling(args.temp, args.top_p, args.seed),
                         max_new_tokens=args.max_new_tokens, system=args.system)
            return 0
        tok = Tokenizer.from_file(chat.tokenizer)
        session = Session(chat.template, Sampling(args.temp, args.top_p, args.seed), system=args.system)
        if args.prompt is not None:
            answer(engine, session, tok, args.prompt, max_new_tokens=args.max_new_tokens)
        else:
            banner = (f"megaft-chat: {chat.origin}, {nproc} rank(s), template "
                      f"{chat.template.name if chat.template else 'none'}")
            chat_loop(engine, session, tok, max_new_tokens=args.max_new_tokens, banner=banner)
    except RankError as exc:
        print(f"megaft-chat: {exc}", file=sys.stderr)
        return 1
    except (ChatError, ValueError) as exc:  # DataError, HFCheckpointError: a template or checkpoint to fix
        print(f"megaft-chat: {exc}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.close()
    return 0


def _engine(chat, nproc: int, device: str):
    from megaft.chat.engine import LocalEngine, RanksEngine

    if nproc > 1:
        return RanksEngine(chat, nproc, device)
    from megaft.launch.rank import pick_device

    return LocalEngine(chat, pick_device(device, 0))


if __name__ == "__main__":
    sys.exit(main())
