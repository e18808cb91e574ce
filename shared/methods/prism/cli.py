"""PRISM's command-line verbs: ``estuary keygen`` writes a fresh key file; ``estuary prism
pack`` and ``estuary prism unpack`` turn a PRISM model into a key-less compact artifact (one
bit per masked weight and a scale per tensor), and back to dense weights given the key.

``pack`` reads a run's latest checkpoint (or a checkpoint file), draws the deployed mask
``M*`` from it exactly as export and deployment do, and writes the mask and the scales as
safetensors; its metadata names the preset, the run seed, the round and the key's
fingerprint, never the key. ``unpack`` regenerates the frozen signs from the key
(``ESTUARY_PRISM_KEY`` / ``ESTUARY_PRISM_KEY_FILE``) and writes the dense state dict, which
``model.init`` or ``estuary export`` of a checkpoint can use; a key with another fingerprint
is refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shared.errors import ConfigError, EstuaryError

MAX_COMPACT_BYTES = 1 << 30


def cmd_pack(args: argparse.Namespace) -> int:
    """Write the compact artifact of a PRISM checkpoint."""
    from shared.atomic import atomic_write
    from shared.methods.prism.masking import COMPACT_FORMAT, compact_tensors, is_masked, load_key
    from shared.methods.registry import make_algorithm
    from shared.models.checkpoint import checkpoint_of, load_checkpoint
    from shared.wire.codec import encode_tensors

    path = checkpoint_of(Path(args.source))
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    if cfg.algorithm.name != "prism":
        raise ConfigError(f"{path} is a {cfg.algorithm.name} run; only PRISM models pack")
    dense = make_algorithm(cfg).format.materialize(ckpt.model)
    tensors = compact_tensors(dense)
    key = load_key()
    meta = {
        "format": COMPACT_FORMAT,
        "preset": cfg.model.preset,
        "seed": str(cfg.run.seed),
        "round": str(ckpt.round + 1),
        "key_fingerprint": key.fingerprint,
        "bit_order": "little: element 8j+i is bit i of byte j; tensors in sorted name order",
    }
    data = encode_tensors(tensors, meta)
    out = Path(args.out)
    atomic_write(out, data)
    masked = sum(t.numel() for k, t in dense.items() if is_masked(k, tuple(t.shape)))
    print(json.dumps({"out": str(out), "bytes": len(data), "masked_weights": masked,
                      "dense_fp32_bytes": 4 * sum(t.numel() for t in dense.values()),
                      **meta}, indent=2))  # fmt: skip
    return 0


def cmd_unpack(args: argparse.Namespace) -> int:
    """Dense weights of a compact artifact, given the key."""
    from shared.atomic import atomic_write
    from shared.methods.prism.masking import COMPACT_FORMAT, expand_compact, load_key
    from shared.models.plan import model_spec
    from shared.wire.codec import decode_tensors, encode_tensors, read_metadata

    src = Path(args.artifact)
    if not src.is_file() or src.stat().st_size > MAX_COMPACT_BYTES:
        raise EstuaryError(f"{src}: no such file, or larger than {MAX_COMPACT_BYTES} bytes")
    data = src.read_bytes()
    meta = read_metadata(data)
    if meta.get("format") != COMPACT_FORMAT:
        raise EstuaryError(f"{src} is not a compact PRISM artifact ({COMPACT_FORMAT})")
    key = load_key()
    if meta.get("key_fingerprint") != key.fingerprint:
        raise ConfigError(
            f"{src} was packed under key {meta.get('key_fingerprint')}, this key is "
            f"{key.fingerprint}: the signs would be another model's"
        )
    try:
        seed = int(meta["seed"])
        spec = model_spec(meta["preset"], None)
    except (KeyError, ValueError) as err:
        raise EstuaryError(f"{src}: bad metadata: {err}") from None
    dense = expand_compact(decode_tensors(data), spec, key, seed)
    out = Path(args.out)
    atomic_write(out, encode_tensors(dense))
    print(json.dumps({"out": str(out), "tensors": len(dense), "preset": meta["preset"]}))
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write a fresh key file and say its fingerprint (never the key)."""
    from shared.methods.prism.masking import KEY_FILE_ENV, generate_key_file

    path = Path(args.path)
    key = generate_key_file(path)
    print(f"wrote {path} (fingerprint {key.fingerprint}); give it to the cloud and the "
          f"training devices as {KEY_FILE_ENV}={path.resolve()}")  # fmt: skip
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``estuary keygen`` and ``estuary prism pack|unpack`` on ``sub`` (argparse
    subparsers)."""
    k = sub.add_parser(
        "keygen",
        help="write a fresh 256-bit PRISM key file (hex, mode 0600) and print its fingerprint",
    )
    k.add_argument("path", help="the key file to create (never overwritten)")
    k.set_defaults(func=cmd_keygen)
    p = sub.add_parser("prism", help="PRISM models as key-less compact artifacts, and back")
    actions = p.add_subparsers(dest="prism_command", required=True)
    pk = actions.add_parser("pack", help="a checkpoint's deployed mask, 1 bit per weight")
    pk.add_argument("source", help="run directory or checkpoint file of a PRISM run")
    pk.add_argument("--out", required=True, help="the compact .safetensors file to write")
    pk.set_defaults(func=cmd_pack)
    un = actions.add_parser("unpack", help="dense weights of a compact artifact (needs the key)")
    un.add_argument("artifact", help="a file `estuary prism pack` wrote")
    un.add_argument("--out", required=True, help="the dense state dict (.safetensors) to write")
    un.set_defaults(func=cmd_unpack)
