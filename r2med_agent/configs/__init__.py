"""YAML registries, installed as r2med_agent.configs."""
