"""opd.merge"""
