"""The MoE model package both sides share (the layer between ``protocol`` and
``edge_sdk``/``cloud``): model-family adapters (``models/``), sub-MoE building with LoRA
(``submoe``), base shards (``shards``), the memory plan and process memory (``budget``),
quantized expert weights (``quant``, ``quant_bnb``), activation statistics (``stats``),
local training/evaluation (``train``) and torch-free log filters (``notices``). It imports
only ``protocol`` and libraries.
"""
