"""fedhisto: reproducible stain-aware parameter-efficient federated learning for lung histopathology."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedhisto")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

#: Fixed class order used everywhere (the study's: ACA, Normal, SCC).
CLASSES: tuple[str, ...] = ("ACA", "Normal", "SCC")

__all__ = ["CLASSES", "__version__"]
