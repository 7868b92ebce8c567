"""Engine side: runs inside vLLM's processes; the only code that imports vLLM."""
