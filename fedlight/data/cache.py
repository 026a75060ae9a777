"""Decode image files once and keep the result on disk as uint8 tensors.

The cache lives in ``$FEDLIGHT_CACHE`` (default ``~/.cache/fedlight``), never next to the data, so the
data root may be read-only. Entries are keyed by a hash of everything that determines them (decodes: each
file's path, size and modification/status-change times, see :func:`decode_key`)
and written atomically (temporary file in the same folder, then :func:`os.replace`), so a crash or two
processes writing at once can never leave a half-written entry behind. A cache that cannot be written
is skipped with a warning; it never stops a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedlight.errors import ConfigError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp", ".gif")


def cache_dir() -> Path:
    """The cache folder: ``$FEDLIGHT_CACHE`` if set, else ``~/.cache/fedlight``."""
    env = os.environ.get("FEDLIGHT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedlight"


def digest(*parts: object) -> str:
    """A stable hex key for ``parts`` (arrays hash their dtype, shape and bytes; the rest their ``repr``)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Tensor):
            part = part.detach().cpu().numpy()
        if isinstance(part, np.ndarray):
            data = str((part.dtype.str, part.shape)).encode() + np.ascontiguousarray(part).tobytes()
        elif isinstance(part, bytes):
            data = part
        else:
            data = repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def file_digest(files: Sequence[Path]) -> str:
    """A hex key for the content of ``files`` (read in 1 MiB chunks; the order counts)."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):  # noqa: B023 - fh is the loop's file
                h.update(chunk)
        h.update(b"\0" + Path(f).name.encode() + b"\0")
    return h.hexdigest()[:32]


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` through a temporary file and :func:`os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cache entries are meant to be shareable
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cached(kind: str, key: str, build: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
    """Load ``<cache>/<kind>/<key>.pt`` if present, else ``build()`` it and store it atomically.

    Args:
        kind: Sub-folder of the cache (``"images"``, ``"partitions"``).
        key: Content hash from :func:`digest`.
        build: Makes the value (a dict of CPU tensors) on a cache miss.
    """
    path = cache_dir() / kind / f"{key}.pt"
    if path.is_file():
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt entry is rebuilt, not fatal
            warnings.warn(f"fedlight: ignoring unreadable cache file {path} ({e}); rebuilding it", stacklevel=2)
    value = build()
    try:
        atomic_save(value, path)
    except OSError as e:
        warnings.warn(
            f"fedlight: could not write the cache file {path} ({e}); set FEDLIGHT_CACHE to a writable folder",
            stacklevel=2,
        )
    return value


def is_cached(kind: str, key: str) -> bool:
    """Whether the entry ``<cache>/<kind>/<key>.pt`` exists."""
    return (cache_dir() / kind / f"{key}.pt").is_file()


def _decode_pil(path: str) -> Tensor:
    from PIL import Image

    try:
        with Image.open(path) as im:
            return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).contiguous()
    except (OSError, ValueError, SyntaxError) as e:  # PIL's UnidentifiedImageError is an OSError
        raise ConfigError(f"{path} is not a readable image ({type(e).__name__}: {str(e)[:120]}); remove or replace "
                          "it") from None


def decode_image(path: str, image_size: int | None = None) -> Tensor:
    """Decode one image file to a uint8 RGB tensor ``[3, H, W]``, optionally resized to a square.

    Decoding goes through ``torchvision.io`` (libjpeg/libpng, deterministic, about twice as fast as PIL
    and pixel-identical to it on the CIFAR-10 JPEGs), with PIL for formats it cannot read or once
    torchvision drops it. Resizing is bilinear with antialiasing to ``image_size x image_size``
    (the aspect ratio is not kept; OfficeHome-style collections are commonly resized this way).
    """
    try:
        from torchvision.io import ImageReadMode, read_file
        from torchvision.io import decode_image as tv_decode

        img = tv_decode(read_file(path), mode=ImageReadMode.RGB)
    except (ImportError, RuntimeError):
        img = _decode_pil(path)
    if image_size is not None and tuple(img.shape[1:]) != (image_size, image_size):
        from torchvision.transforms.v2.functional import resize

        img = resize(img, [image_size, image_size], antialias=True)
    return img


def decode_files(paths: Sequence[str], image_size: int | None = None) -> Tensor:
    """Decode ``paths`` (in order) into one uint8 tensor ``[n, 3, H, W]`` using a few threads."""
    workers = max(1, min(8, os.cpu_count() or 1))
    with warnings.catch_warnings(), ThreadPoolExecutor(max_workers=workers) as pool:
        # torchvision 0.29 deprecates its decoders in favour of torchcodec; PIL takes over once they go
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torchvision\.io")
        images = list(pool.map(lambda p: decode_image(p, image_size), paths, chunksize=64))
    if not images:
        return torch.zeros(0, 3, image_size or 1, image_size or 1, dtype=torch.uint8)
    shapes = {tuple(im.shape) for im in images}
    if len(shapes) > 1:
        raise ConfigError(
            f"images have different sizes ({sorted(shapes)[:3]} ...); set `data.init_args.image_size` "
            "to resize them to one square size"
        )
    return torch.stack(images)


def decode_key(paths: Sequence[str], image_size: int | None = None) -> str:
    """Cache key of a decode: the file paths, their byte sizes, modification and status-change times, and
    ``image_size``. A file rewritten in place changes its status-change time (which no user call can set back),
    so even a same-size rewrite with its modification time restored is decoded again; hashing the bytes of every
    file instead costs seconds per run (4.1 s for CIFAR-10's 50,000 training JPEGs on a busy 2-core machine)."""
    st = [os.stat(p) for p in paths]
    stamps = np.array([(s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in st], dtype=np.int64).reshape(-1, 3)
    return digest("decode-v2", list(paths), stamps, image_size)


def cached_decode(paths: Sequence[str], image_size: int | None = None, key: str | None = None) -> Tensor:
    """:func:`decode_files` through the cache (``key`` defaults to :func:`decode_key`)."""
    key = key or decode_key(paths, image_size)
    return cached("images", key, lambda: {"x": decode_files(paths, image_size)})["x"]
