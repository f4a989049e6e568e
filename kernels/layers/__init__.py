"""The layer ops: what a layer runs around its sequence mixer, one subpackage each, with the mixers' op layout.

``layer_norm`` (and ``add_layer_norm``), ``gated_rmsnorm`` (a mixer's output norm and gate) and ``mixer_prologue``
(the input stage a mixer layer declares with a :class:`~visionssm.kernels.layers.mixer_prologue.PrologueSpec`).
XX
``visionssm.kernels.LAYER_OPS`` lists them.
"""
