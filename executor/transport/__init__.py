"""transport: ZeroMQ messages between the processes of a job.

Owns the wire format (wire.proto, wire.py: a protobuf header and raw tensor frames,
every field checked when decoded; nothing is unpickled or evaluated), request /
reply over ROUTER and DEALER sockets with heartbeats, request ids and incarnations
(rpc.py), the settings that tune them (settings.py), and CURVE keys and client
allow-lists (security.py). It knows nothing of what the messages mean.

May import: fluidps.errors, fluidps.endpoints, fluidps.ir.types, fluidps.ops.selected_rows, fluidps.profiling
"""
