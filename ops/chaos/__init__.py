"""`epd chaos`: fault scenarios on real processes (SIGKILL, SIGSTOP, overload, disconnects, a stack
stop, a taken port) with a table of what every request saw.

  stack.py      the stack worked on: started (default topology, 2 prefill + 2 decode workers) or attached
  client.py     HTTP requests with deadlines, recording when each chunk arrived
  runner.py     the shared context, prompts and steps of the scenarios
  faults.py     decode_kill, decode_freeze, prefill_kill, router_restart
  store.py      kv_writer_kill
  load.py       storm, disconnect
  lifecycle.py  drain, bind_fail
  scenarios.py  the scenarios by name, in the order they run
  table.py      Row, the comparison with the fault-free run, the printed table
  command.py    the `epd chaos` command
"""
