"""dsv4.cli"""
