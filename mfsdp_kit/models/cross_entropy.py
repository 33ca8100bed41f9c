"""The kit's cross-entropy from the logits in their own dtype (`EngineConfig.kernels.fused_cross_entropy`): now
`distributed.cross_entropy`, beside `engine.build`, which puts it into the models it builds (imports point down).
This path keeps working: the same functions."""
from ..distributed.cross_entropy import cross_entropy, language_model_loss, use_in  # noqa: F401
