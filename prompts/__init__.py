"""Jinja prompt templates, installed as r2med_agent.prompts."""
