"""Tools: trace files, their summary, timeline and replay, the ``vllm-journey`` CLI.

Never import the engine side.
"""
