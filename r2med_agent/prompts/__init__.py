"""Prompt templates (Jinja files and example YAML), installed as the data package r2med_agent.prompts.

No code lives here: r2med_agent.prompt_templates finds, renders and hashes these files.
"""
