"""Registry entries, one module per area; each module exposes ``PATCHES: list[Patch]``.

* :mod:`.device_namespace` -- ``torch.cuda`` / ``device="cuda"`` routing in Megatron modules
* :mod:`.rng` -- the device RNG state get/set behind the model-parallel RNG tracker
* :mod:`.tensor_methods` -- ``Tensor.cuda()`` and Megatron's ``Tensor.type()`` checks
"""
