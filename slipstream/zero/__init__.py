"""ZeRO: partition math, flat buffers, stages 0-2, loss scaling."""
