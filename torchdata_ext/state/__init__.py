"""State conventions shared by every node: the graph of node states, the deltas a worker sends,
and the reader's compact cursors.
"""
