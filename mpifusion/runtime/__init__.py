"""The fused buffers at run time: params, flat storage, FusedCommBuffer, fused_parameters."""
