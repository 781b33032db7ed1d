"""Per-example rules, one module per family of layers.

:mod:`~privlearn.torch.rules.linear`, :mod:`~privlearn.torch.rules.conv`,
:mod:`~privlearn.torch.rules.embedding` and :mod:`~privlearn.torch.rules.norm` hold the
rules for PyTorch's ``Linear``, ``Conv1d``/``Conv2d``, ``Embedding`` and
``LayerNorm``/``GroupNorm`` (registered by type when imported).

:mod:`privlearn.torch.rules.transformers` recognises layers of Hugging Face
``transformers`` (and look-alikes) by class name and attributes, without importing the
library: ``Conv1D`` (GPT-2), Llama/Qwen/Mistral/T5-style ``*RMSNorm`` modules and
``torch.nn.RMSNorm``, ``*ScaledWordEmbedding`` lookups (Gemma, BART), ``FalconLinear``
and ViT's embeddings (class token and position embedding parameters). Each class-name
match is checked once per module instance against the generic :mod:`torch.func` fallback
on two examples; a module whose behaviour differs from the rule's assumptions is then
handled by the fallback instead (with a warning).

:mod:`privlearn.torch.rules.opacus` recognises Opacus's DP layers (``DPLSTM``,
``DPGRU``, ``DPRNN``, ``SequenceBias``, ``DPMultiheadAttention``) the same way, by class
and module path, without importing Opacus.

The recurrent rules (:mod:`privlearn.torch.rnn`) and the attention rule with its
instrumenter (:mod:`privlearn.torch.attention`) live next to their larger helpers and are
loaded here too: importing this package is the one place every built-in rule, predicate
rule and instrumenter is registered (:func:`~privlearn.torch.grad_sample.register_rule`,
:func:`~privlearn.torch.grad_sample.register_predicate_rule`,
:func:`~privlearn.torch.grad_sample.register_instrumenter`). A user extension registers
its own with the same decorators; nothing else is needed. The layouts container modules
give the layers inside them (``nn.TransformerEncoderLayer``'s ``batch_first``) are
registered here too (:func:`~privlearn.torch.grad_sample.register_layout`).
"""

from torch import nn

from privlearn.torch import attention, rnn  # noqa: F401  (registers)
from privlearn.torch.grad_sample import register_layout
from privlearn.torch.rules import (  # noqa: F401  (registers)
    conv,
    embedding,
    linear,
    norm,
    opacus,
    transformers,  # noqa: F401  (registers the rules)
)

# PyTorch's transformer layers pass their (batch_first or sequence-first) activations to
# their Linear and LayerNorm children unchanged: those take the layout of the layer
register_layout(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)(
    lambda m: 0 if m.self_attn.batch_first else 1)
