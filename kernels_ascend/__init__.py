"""torch_npu operator adapters for the Ascend backend, one op family per file."""
