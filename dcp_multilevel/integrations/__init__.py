"""Adapters that route training stacks' checkpoints through dcp_multilevel.

One module per stack, each an optional extra, imported only by its users
(the core package never imports this one): ``integrations.lightning``
(``pip install dcp_multilevel[lightning]``), ``integrations.accelerate``
(``[accelerate]``), ``integrations.torchtitan`` (``[torchtitan]``). Each is
a thin layer over the names ``dcp_multilevel`` exports. See
``docs/integrations.md``.
"""
