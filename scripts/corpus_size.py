"""Build (or find cached) a built-in corpus and print its size as one JSON line.

    PYTHONPATH=. python scripts/corpus_size.py [code|python|stdlib] [--vocab N]

Prints the files listed, kept and dropped (by reason), their bytes, the tokens, and the seconds
default_dataset took (a build, or only listing and hashing when the cache already holds it).
"""

import argparse
import json
import time

from fp4lab.train.corpus import CORPORA, default_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="code", choices=CORPORA)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    start = time.perf_counter()
    out = default_dataset(args.name, vocab_size=args.vocab)
    seconds = time.perf_counter() - start
    meta = json.loads((out / "meta.json").read_text())
    print(json.dumps({"corpus": args.name, "path": str(out), "files": meta["identity"]["files"],
                      "bytes": meta["identity"]["bytes"], "kept_files": meta["filters"]["kept_files"],
                      "kept_bytes": meta["filters"]["kept_bytes"], "dropped": meta["filters"]["dropped"],
                      "tokens": meta["tokens"], "vocab_size": meta["vocab_size"],
                      "bytes_per_token": round(meta["filters"]["kept_bytes"] / meta["tokens"], 3),
                      "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
