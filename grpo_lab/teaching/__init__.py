"""Teaching helpers on top of the package: plots, widgets, exercise checks.
Course administration is grpo_lab.instructor, one floor up. Nothing below
this floor imports it."""
