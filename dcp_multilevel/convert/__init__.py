"""Conversion between dcp_multilevel checkpoints and the formats DCP users already use.

::

    from dcp_multilevel.convert import convert

    convert("/ckpt/step-100", "model.pt", to="torch")          # torch.save file
    convert("/ckpt/step-100", "model.safetensors", to="safetensors")
    convert("/ckpt/step-100", "/stock/step-100", to="dcp")     # FileSystemWriter layout
    convert("/stock/step-100", "/ckpt/step-100", to="ours", codec="bytegroup")
    convert("model.pt", "/ckpt/step-0", to="ours")

Modules: ``api.py`` (:func:`convert`, :class:`ConvertReport`), ``sources.py``
(what a source is, and reading one into file-backed tensors), ``scratch.py``
(those tensors), ``to_file.py`` (torch.save, safetensors), ``to_dcp.py`` (stock
DCP, ours), ``progress.py``. See ``docs/interop.md``.
"""

from .api import TARGET_KINDS, ConvertReport, convert
from .sources import SOURCE_KINDS, detect_source

__all__ = ["SOURCE_KINDS", "TARGET_KINDS", "ConvertReport", "convert", "detect_source"]
