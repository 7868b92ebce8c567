"""Export side: the exporter process, and span building in the engine core in thread mode.

Never imports the engine side.
"""
