"""Development tools that sit beside the daemon: nothing in clients/, scheduler/ or workers/ imports them.

Run from a checkout (``python -m tools...`` at the repository root); they are not installed with the
package, because serving needs none of them.
"""
