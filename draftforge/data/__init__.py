"""draftforge.data"""
