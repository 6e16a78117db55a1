"""Prefect flows: thin wrappers that move data between the warehouse, the core and engines.

Deployments are in ../prefect.yaml. Everything here runs on Prefect's ephemeral API when no
server is configured.
"""
