"""User-facing configuration: compression options and the levels of a manager.

Both are defined next to what uses them (``codecs/options.py``,
``levels/options.py``) and gathered here.
"""

from .codecs.options import Compression
from .levels.options import Level

__all__ = ["Compression", "Level"]
