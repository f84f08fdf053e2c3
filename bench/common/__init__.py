"""What the benchmarks share: printed tables and JSON results (table.py), a local stack started for a
run (local_stack.py), topology edits (topology_edit.py), CPU pinning (cpu_pinning.py) and the plain
streaming traffic whose TTFT the grammar and vision benches measure (plain_traffic.py)."""
