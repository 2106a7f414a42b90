"""The exception both sides of a grading kernel raise when the student's code
changed what a verdict depends on.

The kernel's guard (:mod:`grpo_lab.instructor.grading_kernel`) raises it after
putting the recorded state back; the child (:mod:`grpo_lab.instructor.grading_child`)
reports it, and the kernel raises it again from the child's reply. Its own
module, so that neither of the two imports the other for it.
"""

from __future__ import annotations


class Tampered(Exception):
    """The solution changed something the verdict depends on."""
