"""The MoE model package both sides share (the layer between ``protocol`` and
``edge_sdk``/``cloud``): model-family adapters (``models/``), sub-MoE building with LoRA
(``submoe``), base shards (``shards``), the memory plan and process memory (``budget``),
quantized expert weights (``quant``, ``quant_bnb``), activation statistics (``stats``)
and local training/evaluation (``train``). It imports only ``protocol`` and libraries.
"""
