"""The router process: the serving runtime live (core.py), its executor on the stage-worker
nodes, transports and stage clients, its timers, and its front door (door/)."""
