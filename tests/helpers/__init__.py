"""Helpers and fixtures that tests of several kinds (unit, engine, end-to-end) share.

Test modules import a fixture from here as ``from tests.helpers.x import name as name`` (the explicit
re-export form), so that the test's parameter of the same name is not a redefinition of an unused import.
"""
