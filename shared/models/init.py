"""Where a run's first global model comes from: ``model.init`` = ``random`` (drawn from the
run's seed), ``pretrained`` (the preset's generator shipped in ``shared/assets``, checked
against its recorded sha256), or the path of a safetensors file (an Estuary checkpoint of a
dense model, or a bare state dict), verified before use.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.errors import CodecError, ConfigError
from shared.models.checkpoint import MODEL_PREFIX, STATE_PREFIX, decode_checkpoint, is_checkpoint
from shared.models.presets import build_net, state_spec
from shared.wire.codec import check_spec, decode_tensors, file_sha256, sha256_hex

ASSETS = Path(__file__).resolve().parents[1] / "assets"
#: generators pretrained by ``scripts/pretrain_generator.py`` and shipped in shared/assets:
#: preset -> (file name, sha256 of the file). A retrained file needs its new hash here.
PRETRAINED: dict[str, tuple[str, str]] = {
    "fmnist-tiny": (
        "fmnist_tiny_pretrained.safetensors",
        "cb94f6c712b4607bce09f5a43ade834d019068829b7c12552b6404fc18229109",
    ),
    "fmnist-tiny-cfg": (
        "fmnist_tiny_cfg_pretrained.safetensors",
        "88bef68b340261d391bdeb49e7f5d1af9af408e68161021817949646f30ead86",
    ),
    "fmnist-tiny-dom": (
        "fmnist_tiny_dom_pretrained.safetensors",
        "c4c000071aa2d867ce3c76df229cabaca83e20904dac78abd9f8d3b6f7ddaa7f",
    ),
}
#: other starting generators shipped in shared/assets, which ``model.init`` names by path:
#: file name -> sha256 of the file (checked whenever a run starts from that file there)
SHIPPED_STARTS: dict[str, str] = {
    # fmnist-tiny on the clothes only (the demo's start; scripts/pretrain_generator.py
    # --classes 0,1,2,3,4,6, recipe in fmnist_tiny_clothes.json)
    "fmnist_tiny_clothes.safetensors": (
        "6654e31523d1bd0848f278f9babd359552018db2883039d5f2cc16f9f4237650"
    ),
}
#: largest file ``model.init`` may name (ddpm-cifar10 in fp32 is 143 MB)
MAX_INIT_BYTES = 1 << 30
PRETRAIN_HINT = "Retrain it with `python scripts/pretrain_generator.py`"


def pretrained_path(preset: str) -> Path:
    """The shipped pretrained generator of ``preset`` (ConfigError when there is none)."""
    if preset not in PRETRAINED:
        raise ConfigError(
            f"model.init = 'pretrained': no pretrained generator ships for preset {preset!r} "
            f"(available: {sorted(PRETRAINED)}); use 'random' or the path of a checkpoint"
        )
    return ASSETS / PRETRAINED[preset][0]


def shipped_start_sha256(path: Path) -> str | None:
    """The recorded sha256 of ``path`` when it is a starting generator shipped in
    shared/assets (:data:`SHIPPED_STARTS`), else None."""
    try:
        in_assets = path.resolve().parent == ASSETS.resolve()
    except OSError:
        return None
    return SHIPPED_STARTS.get(path.name) if in_assets else None


def load_init_state(preset: str, init: str) -> dict[str, torch.Tensor] | None:
    """The state dict ``model.init`` names for a dense ``preset``, verified; None for 'random'.

    'pretrained' is the shipped file, checked against its recorded sha256. A path may hold
    an Estuary checkpoint (its model part is used; a pruned one is refused) or a bare state
    dict. Either way the tensors must be exactly the preset's (names, shapes, dtypes) and
    finite; nothing is unpickled. Raises ConfigError naming the file and what is wrong.
    """
    if init == "random":
        return None
    path = pretrained_path(preset) if init == "pretrained" else Path(init)
    try:
        size = path.stat().st_size
        if size > MAX_INIT_BYTES:
            raise ConfigError(f"model.init {path}: {size} bytes, more than {MAX_INIT_BYTES}")
        data = path.read_bytes()
    except OSError as err:
        hint = f" {PRETRAIN_HINT}." if init == "pretrained" else ""
        raise ConfigError(f"model.init: cannot read {path}: {err.strerror}.{hint}") from None
    digest = sha256_hex(data)
    shipped = shipped_start_sha256(path)
    if shipped is not None and digest != shipped:
        raise ConfigError(
            f"model.init: {path} has sha256 {digest[:16]}…, expected {shipped[:16]}… (the "
            "shipped file's); it is corrupt or from another training run. Retrain it with "
            "the command in its .json recipe and update SHIPPED_STARTS in "
            "shared/models/init.py."
        )
    if init == "pretrained" and digest != PRETRAINED[preset][1]:
        raise ConfigError(
            f"model.init: {path} has sha256 {digest[:16]}…, expected "
            f"{PRETRAINED[preset][1][:16]}…; the file is corrupt or from another training "
            f"run. {PRETRAIN_HINT} and update PRETRAINED in shared/models/init.py."
        )
    try:
        if is_checkpoint(data):
            ckpt = decode_checkpoint(data, path)
            if ckpt.plan is not None:
                raise CodecError("it is a checkpoint of a pruned model; init needs a dense one")
            tensors = ckpt.model
        else:
            tensors = decode_tensors(data)
            if any(k.startswith((MODEL_PREFIX, STATE_PREFIX)) for k in tensors):
                raise CodecError("tensor names look like a checkpoint's, but its metadata is not")
        check_spec(tensors, state_spec(preset))
    except CodecError as err:
        raise ConfigError(f"model.init {path} does not hold a {preset} model: {err}") from None
    return tensors


def init_fingerprint(preset: str, init: str) -> str:
    """What ``model.init`` names, by content: ``"random"``, or ``"sha256:<hex>"`` of the file
    (the recorded hash for ``"pretrained"``, the file's bytes for a path).

    The config digest keys a path by its string, so a record that must notice a file being
    replaced at the same path (``estuary compare``'s finished runs) keeps this beside it, and
    checkpoints record it so that a resume can tell a moved init file from another one.
    Never raises: an unreadable or oversized file gives a ``"unreadable: …"`` value that no
    recorded fingerprint equals, and the run that follows reports the ConfigError.
    """
    if init == "random":
        return "random"
    if init == "pretrained":
        return f"sha256:{PRETRAINED[preset][1]}" if preset in PRETRAINED else "unreadable: none"
    try:
        if Path(init).stat().st_size > MAX_INIT_BYTES:
            return f"unreadable: more than {MAX_INIT_BYTES} bytes"
        return f"sha256:{file_sha256(init)}"
    except OSError as err:
        return f"unreadable: {err.strerror}"


def initial_model(preset: str, init: str = "random", *, seed: int = 0) -> nn.Module:
    """The first global model of a run: :func:`~shared.models.presets.build_net` (a U-Net or
    a one-shot generator) from ``seed``, then the weights ``init`` names loaded into it (see
    :func:`load_init_state`)."""
    model = build_net(preset, seed=seed)
    state = load_init_state(preset, init)
    if state is not None:
        model.load_state_dict(state)
    return model
