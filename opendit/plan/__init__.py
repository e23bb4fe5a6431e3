"""The memory planner: the fastest set of memory options that fits a budget (train.py --memory_budget, python -m
opendit.plan). measure: the model's parameters and measured activations; account: bytes per part under a plan;
planner: the search and its cost model; report: budgets, the table. docs/memory_planner.md explains it."""
from opendit.plan.account import PARTS, Run, account
from opendit.plan.planner import Options, choose, cost
from opendit.plan.report import apply_memory_budget, parse_budget, plan_config

__all__ = ["PARTS", "Options", "Run", "account", "apply_memory_budget", "choose", "cost", "parse_budget", "plan_config"]
