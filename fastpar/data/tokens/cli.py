"""``fastpar data``: ``fastpar data prepare TEXT... --out DIR`` writes token shards for ``token_loader``."""

from __future__ import annotations

import argparse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpar data", description="Prepare data for fastpar.data's loaders.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{prepare}")
    prepare = commands.add_parser(
        "prepare",
        prog="fastpar data prepare",
        help="tokenize text files into token shards + index.json for fastpar.data.token_loader",
        description="Tokenize text files (each one document, ended by the end-of-text token) into train_*.bin / "
        "val_*.bin shards and an index.json that fastpar.data.token_loader(DIR, split=...) reads.",
    )
    prepare.add_argument("text", nargs="+", metavar="TEXT", help="text files, folders (recursive) or globs")
    prepare.add_argument("--out", required=True, metavar="DIR", help="folder to write the shards and index.json to")
    prepare.add_argument(
        "--tokenizer", default="bytes", help="bytes (default; no dependencies), tiktoken:NAME or hf:PATH/tokenizer.json"
    )
    prepare.add_argument("--val-fraction", type=float, default=0.01, metavar="F", help="documents for val (0.01)")
    prepare.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N", help="tokens per shard")
    prepare.add_argument(
        "--suffix", action="append", default=[], metavar="SUF", help="in folders, only files ending so (e.g. .py)"
    )
    prepare.add_argument("--seed", type=int, default=0, help="picks the val documents")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from .prepare import prepare_tokens  # numpy and the tokenizer load after --help

    index = prepare_tokens(
        args.text,
        args.out,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        suffixes=args.suffix,
        seed=args.seed,
    )
    for split, entry in index["splits"].items():
        print(f"{split}: {entry['tokens']} tokens, {entry['documents']} documents, {len(entry['shards'])} shards")
    print(f"wrote {args.out}/index.json ({index['tokenizer']}, vocab_size {index['vocab_size']}, {index['dtype']})")
    return 0
