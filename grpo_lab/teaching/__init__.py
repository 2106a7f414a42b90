"""Teaching helpers on top of the package: plots, widgets, exercise checks,
student-copy generation. Nothing below this floor imports it."""
