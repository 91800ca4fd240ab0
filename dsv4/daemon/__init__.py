"""dsv4.daemon"""
