"""Supervised fine-tuning (``vpo sft``): the cold start that teaches a task's answer format before RL."""
