"""dsv4.model"""
