"""Stand-ins for the native extensions MegaBlocks needs but only builds for CUDA."""
