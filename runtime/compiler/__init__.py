"""The compiler: Nodes (ir.py), the passes, Instructions and lowering, the listing, the
executor that runs every program's Instructions, and the step controller."""
